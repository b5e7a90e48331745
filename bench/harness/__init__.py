"""What the scenarios share: the run's setup and rows, the llama.cpp baseline, `mesh serve` children,
the streaming client, busy fractions and the hop breakdown, llama.cpp's servers and their delay proxy."""
