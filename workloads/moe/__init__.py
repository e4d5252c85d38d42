"""The MoE layer's pieces: router, token dispatchers (expert parallelism) and expert compute backends."""
