"""The ``memsched`` command line: :mod:`.main` dispatches to one module per command (:mod:`.demo`,
:mod:`.plan`, :mod:`.trace`, :mod:`.report`, :mod:`.policies`); :mod:`.parsers` and :mod:`.argtypes` build the
argument parsers without importing torch."""
