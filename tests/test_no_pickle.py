"""No code path may turn bytes into code: no pickle (torch.load, numpy's allow_pickle, shelve,
dill), no marshal, no eval or exec, anywhere in the server or client packages. Weights come as raw
tensor bytes or safetensors files, which hold no code."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = (ROOT / "server" / "tokensampler_server", ROOT / "client" / "tokensampler_client")
FORBIDDEN = re.compile(
    r"\bc?pickle\b|\bdill\b|\bshelve\b|\bmarshal\b|\btorch\.load\b|allow_pickle\s*=\s*True"
    r"|(?<![\w.])eval\s*\(|(?<![\w.])exec\s*\(|__import__\s*\("  # not method calls such as module.eval()
)


def test_the_forbidden_pattern_catches_each_form() -> None:
    for line in ("import pickle", "torch.load(f)", "np.load(f, allow_pickle=True)", "eval(text)", "exec (code)",
                 "import marshal", "builtins.__import__('os')"):
        assert FORBIDDEN.search(line), line
    assert not FORBIDDEN.search("model.eval()")


def test_no_pickle_marshal_eval_or_exec_in_the_packages() -> None:
    files = [path for package in PACKAGES for path in package.rglob("*.py")]
    assert len(files) > 30  # both packages were found
    hits = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in files
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
        if FORBIDDEN.search(line)
    ]
    assert not hits, "\n".join(hits)
