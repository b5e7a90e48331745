"""`mesh bench`: scenarios against the mesh, compared with single-node llama.cpp in the same run."""
