"""The head-type catalog: one module per type. See README.md in this folder to contribute one."""
