import sys

from gradmesh.cli import main

sys.exit(main())
