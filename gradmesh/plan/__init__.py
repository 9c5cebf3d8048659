"""Planning: how to cut and place a model, from measured costs."""
