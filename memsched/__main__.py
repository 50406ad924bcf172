import sys

from memsched.cli import main

sys.exit(main())
