import sys

from memsched.cli.main import main

sys.exit(main())
