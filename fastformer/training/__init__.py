"""The parts of ``python -m fastformer.train`` (its ``main()`` puts them together), each usable alone:

- ``processes``: the one place that knows about several processes (torchrun): ranks, the device,
  DistributedDataParallel, and every collective the trainer makes.
- ``run``: ``Run``, what the loop holds, and ``Step``, how one update trains (imports nothing of the trainer).
- ``setup``: the run from the command line: corpus, tokenizer, model, optimizer, precision, the training
  state fresh or resumed, and its step (eager, or CUDA graphs).
- ``batches``: each rank's stream of batches, epoch after epoch, with a position that a checkpoint holds.
- ``finetune``: ``--init CHECKPOINT``: a trained or converted model as the start (its config, weights,
  tokenizer and languages), and the flags whose defaults --init changes (the fine-tuning schedule).
- ``step``: the paper's recipe for one update (learning-rate schedule, label-smoothed loss, gradient
  accumulation to a token count, Adam): ``train_step``, and ``EagerStep``, the step run op by op.
- ``graphs``: ``CudaGraphs``, the same step replayed as CUDA graphs (--cuda-graphs).
- ``optim``: Adam as one fused pass that also writes the weights' compute-dtype copies (fastformer's kernel).
- ``resume``: what a checkpoint must hold for every rank to continue bit-identically, written and read.
- ``evaluation``: dev loss and dev BLEU during training, the final test with beam search.
- ``runlog``: ``log.jsonl`` and ``loss.png``.
- ``loop``: the training loop and the end of a run.
- ``copies``: what a step copies or casts of what it had already computed, counted (issue 52; tools/profile_step.py
  and tests/train/test_step_copies.py use it).
"""
