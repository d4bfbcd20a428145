"""A module that takes seconds to import, as torch and transformers do on a loaded host: a
cell preloads it (tests/infra/cells/test_heal_step.py). ``DONE_AT``: when its import ended
(wall clock)."""

import time

time.sleep(6.0)
DONE_AT = time.time()
