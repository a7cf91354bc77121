"""`python -m simulator`: the ETTR simulator's command line (`simulator.ettr`)."""

from simulator.ettr import main

main()
