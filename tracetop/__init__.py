"""tracetop's shared core: the wire contract and shipper (tracetop.wire), the event model
(tracetop.events), and the environment variables every part reads (tracetop.env).

Imports nothing from the other packages of the project (DESIGN.md §2).
"""

__version__ = "0.1.0"
