"""Reports: the memory timeline report (:mod:`.text`, rich), its panels (:mod:`.plan`, :mod:`.steps`,
:mod:`.history`, :mod:`.category_bars`), per-rank reports (:mod:`.ranks`), the progress line
(:mod:`.progress`) and the file exports (:mod:`.exports`: JSON, Perfetto, PNG, PyTorch memory_viz)."""
