"""pagedserve: command line, model resolution and the Python client shared by both processes."""
