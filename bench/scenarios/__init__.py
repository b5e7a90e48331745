"""One module per `mesh bench --scenarios` name (`return_` for return, a Python keyword); bench/run.py
lists them in the order a run measures them."""
