"""The command line: ``python -m ckpt_offload {demo,profile,plan,info}``.

* :mod:`ckpt_offload.cli.commands`: the parser and the ``demo``, ``profile`` and ``info`` commands;
* :mod:`ckpt_offload.cli.plan`: the ``plan`` command;
* :mod:`ckpt_offload.cli._common`: what they share (argument types, ``--script``, ``--out`` checks).

Example::

    from ckpt_offload.cli import main
    status = main(["info"])
"""

from ckpt_offload.cli.commands import build_parser, main

__all__ = ["main", "build_parser"]
