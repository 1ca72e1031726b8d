"""`tandem repro PAPER`: regenerate one paper's comparison into docs/results/<paper>/."""
