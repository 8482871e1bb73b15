"""The package logger, ``logging.getLogger("persistrnn")``.

Library code never prints. A first call that calibrates the cost model or
tunes a plan logs at INFO what it does and how long it took; compilations log
at DEBUG. Turn it on with ``logging.basicConfig(level=logging.INFO)`` or
``logging.getLogger("persistrnn").setLevel(logging.INFO)``.
"""

import logging

logger = logging.getLogger("persistrnn")
logger.addHandler(logging.NullHandler())
