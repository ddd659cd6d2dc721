import sys

from tokensampler_server.app.cli import main

sys.exit(main())
