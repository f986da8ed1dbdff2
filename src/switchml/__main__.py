import sys

from switchml.cli import main

sys.exit(main())
