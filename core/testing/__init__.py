"""What a plugin's own test suite can use: conformance suites any backend can run against the
torch_native references (a quantization method against its formats' dequantized reference), the
import-boundary and layering checks, and a live-server launcher."""

from backplane.testing.timing import cold_graph_us, l2_flush_buffer

__all__ = ["cold_graph_us", "l2_flush_buffer"]
