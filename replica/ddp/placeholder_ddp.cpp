// placeholder until the ddp concern lands
