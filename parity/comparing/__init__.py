"""One comparison vocabulary for loss curves (many steps) and layer dumps (one step): tolerances defined
once, one verdict type, one figure saver."""
