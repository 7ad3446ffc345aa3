import sys

from ckptaudit.cli import main

sys.exit(main())
