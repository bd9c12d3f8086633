"""What `python train.py` runs between parsing and training, one concern per module:

* `arguments`: the run fields (`RunArguments`);
* `config_file`: checks of the command line and the `--config` YAML file before TrlParser reads them;
* `preflight`: start-up checks of the run's fields, model, output_dir, free disk space and tracker;
* `resume`: the checkpoint to resume from, checkpoint completeness, stopping on a signal, process-group teardown;
* `sources`: the environment, dataset rows, held-out tasks and reward functions (`load_sources`, `audit_filter`);
* `run_info`: the model a run trains (`resolve_model`) and the facts summary.json records about it;
* `evaluation`: the before/after held-out evaluation;
* `funnel_run`: the Experience Funnel's own run path (`trainer: funnel`).

After training (docs/after-training.md): `evaluate` (`python -m agent_trl.evaluate`: any run, checkpoint, adapter or
model on the run's held-out tasks, with pass@k and pass^k), `export` (a LoRA adapter merged into its base, a folder
vLLM and `transformers serve` load, a model card) and `play` (one episode against a served model).
"""
