# CPU (run on the 2-core machine, 2026-12-02): what monitor.on_warning=switch_fix does to an arm that diverges
# without it. fa2/none at gain 1e6 with the kept sign, a 2 x 128 model, 200 steps, beside its gain-1 arm: without a
# fix (sw_off), and with the warning forced at step 20 or 80 (a W_Q growth threshold of 1e-9 holds at every spectral
# call) and switch_fix (sw_on_20, sw_on_80). It tests the switch, not the warning (forced here). ~2 minutes.
python -m launcher.prepare_data --source kjv --out /tmp/w/kjv2048 --tokenizer bpe --vocab-size 2048
run() {
  python -m launcher.margin margin 'margin.numerics=[fa2/none]' 'margin.gains=[1,1000000]' margin.signs=[kept] \
    margin.schedule=full margin.processes=2 run.out_dir=/tmp/mcpu run.max_steps=200 run.log_interval=2 \
    model.n_layer=2 model.d_model=128 model.n_head=2 model.max_seq_len=64 data.seq_len=64 data.global_batch_size=4 \
    data.micro_batch_size=4 data.data_dir=/tmp/w/kjv2048 optim.warmup_steps=5 eval.interval=0 \
    monitor.spectral_interval=5 monitor.probe_interval=5 monitor.delta_bias_layers=[] precision.dtype=bf16 "$@"
}
run run.experiment=sw_off
for at in 20 80; do
  run run.experiment=sw_on_$at monitor.warning_tie_rate=0 monitor.warning_wq_growth=1e-9 monitor.warning_window=5 \
    monitor.warning_after_step=$at monitor.warning_patience=1 monitor.on_warning=switch_fix
done
