"""The layer both processes and the CLI stand on: configuration, model resolution, wire
conventions. Imports nothing from the processes or the CLI."""
