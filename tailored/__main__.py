import sys

from tailored.cli import main

sys.exit(main())
