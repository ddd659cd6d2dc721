"""A transformers decode loop that samples through tokensampler from hidden states.

  python examples/transformers_decode.py [--target HOST:PORT] [--steps 32] [--device cpu|cuda]

Builds a small Llama-style causal LM from a config with random weights (nothing is downloaded),
registers its `lm_head.weight` with the server (on a GPU in place, by CUDA IPC: the server samples from
the model's own tensor; on the CPU by upload), and decodes by sending the last hidden state of each
step over one SampleStream and feeding the sampled token back:
  1. greedy, checked token for token against the model's own `generate(do_sample=False)`;
  2. seeded top-k/top-p, run twice to show that the same seed gives the same continuation.
Prints tokens/s of each loop. Without --target it starts a tokensampler server of its own.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from local_server import server_target  # beside this file

ROOT = Path(__file__).resolve().parents[1]
WEIGHTS = "example-lm-head"


def small_model(device: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )
    return LlamaForCausalLM(config).to(device).eval()


@torch.no_grad()
def decode(model: LlamaForCausalLM, stream, prompt: torch.Tensor, steps: int, **params) -> tuple[list[int], float]:
    """Generates `steps` tokens; returns them and the tokens per second of the loop."""
    tokens: list[int] = []
    past = None
    inputs = prompt
    started = time.perf_counter()
    for step in range(steps):
        out = model(input_ids=inputs, past_key_values=past, use_cache=True, output_hidden_states=True)
        past = out.past_key_values
        # The last entry of hidden_states is after the final norm: exactly what lm_head reads.
        hidden = out.hidden_states[-1][:, -1, :].float()
        result = stream.sample(hidden=hidden, weights=WEIGHTS, position=prompt.shape[1] + step, **params)
        token = int(result.tokens[0, 0])
        tokens.append(token)
        inputs = torch.tensor([[token]], device=prompt.device)
    return tokens, steps / (time.perf_counter() - started)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="a running server (default: start one)")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    sys.path[:0] = [str(ROOT / "client"), str(ROOT / "server")]
    from tokensampler_client import SamplerClient

    ipc = ["--allow-cuda-ipc"] if args.device.startswith("cuda") else []  # the LM head is shared in place on a GPU
    with server_target(args.target, "--device", args.device, *ipc) as target:
        model = small_model(args.device)
        prompt = torch.randint(0, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(1)).to(args.device)
        with SamplerClient(target, timeout=120) as client:
            head = model.lm_head.weight.detach()
            region = None
            if head.is_cuda:  # the engine's own weight, used in place (the server needs --allow-cuda-ipc)
                region = client.register_cuda_region(WEIGHTS, head)
                torch.cuda.synchronize()
                client.register_weights_from_region(WEIGHTS, region.view_of(head))
            else:
                client.register_weights(WEIGHTS, head.float())
            try:
                with client.stream() as stream:
                    greedy, rate = decode(model, stream, prompt, args.steps, temperature=0.0)
                    expected = model.generate(prompt, max_new_tokens=args.steps, do_sample=False,
                                              pad_token_id=0)[0, prompt.shape[1]:].tolist()
                    print(f"greedy: {rate:.1f} tokens/s; {greedy[:12]}...")
                    if greedy != expected:
                        first = next(i for i, (a, b) in enumerate(zip(greedy, expected)) if a != b)
                        print(f"greedy tokens differ from model.generate at step {first}: {greedy[first]} != {expected[first]}")
                        return 1
                    print(f"greedy tokens match model.generate for all {args.steps} steps")
                    sampled = [decode(model, stream, prompt, args.steps, top_k=50, top_p=0.9, seed=1234)[0] for _ in range(2)]
                    print(f"top-k/top-p (seed 1234): {sampled[0][:12]}...")
                    if sampled[0] != sampled[1]:
                        print("seeded runs differ")
                        return 1
                    print("seeded top-k/top-p continuation is reproducible")
            finally:
                client.unregister_weights(WEIGHTS)
                if region is not None:
                    client.unregister_region(region)
    return 0


if __name__ == "__main__":
    sys.exit(main())
