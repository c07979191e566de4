import sys

from sammie.cli import main

sys.exit(main())
