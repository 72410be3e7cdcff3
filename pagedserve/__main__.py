import sys

from pagedserve.cli.main import main

sys.exit(main())
