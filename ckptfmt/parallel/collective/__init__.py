"""The collective protocol of one checkpoint: every rank of a communicator saves, loads, flushes
or rebuilds it together, each phase behind one error boundary and one vote."""
