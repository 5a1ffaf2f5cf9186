"""``python -m pocketllm``."""

import sys

from pocketllm.cli.main import main

sys.exit(main())
