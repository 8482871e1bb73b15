"""Benchmarks: ``python -m persistrnn bench <suite>`` (the suites are listed in
:data:`persistrnn.bench.__main__.SUITES`). They import the library; the
library never imports them."""
