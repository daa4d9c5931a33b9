"""``pipesim reproduce {pipedream,2bw,spectrain,all}``: the papers' experiments,
predicted from public facts about their machines and models, beside the
published values (:mod:`.base` says what each paper's module provides)."""
