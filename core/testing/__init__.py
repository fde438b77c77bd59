"""What a plugin's own test suite can use: conformance suites any backend can run against the
torch_native references (a quantization method against its formats' dequantized reference), the
import-boundary and layering checks, and a live-server launcher."""
