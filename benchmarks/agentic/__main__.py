import sys

from benchmarks.agentic.cli import main

sys.exit(main())
