"""``python -m maskedbranch.doctor``: the command line lives in the package (cli.py), so that a
factory's ``maskedbranch.doctor.Inputs`` is the class the command line checks for."""
import sys

from maskedbranch.doctor.cli import main

sys.exit(main())
