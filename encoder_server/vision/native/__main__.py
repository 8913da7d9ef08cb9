"""``python -m encoder_server.vision.native [DIR]``: build the native attention kernel ahead of time."""

import sys

from encoder_server.vision.native import main

sys.exit(main())
