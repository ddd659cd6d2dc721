"""The gRPC servicer and what wraps each call: the call guard (authentication, admission, metrics, tracing), the
Sample paths (Python and native) and stream flow control. Imports validation and below, never app."""
