"""Networks: link measurement and, for tests and benchmarks, emulated hosts in namespaces."""
