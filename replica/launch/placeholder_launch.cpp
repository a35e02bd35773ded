// placeholder until the launch concern lands
