"""How verify_trainer.py attaches the recorder to a command it runs, unchanged: the variables (attach.py), import
hooks (import_hook.py), the cut to --num_layers (layer_cut.py, model_builders.py), and the examples' launcher."""
