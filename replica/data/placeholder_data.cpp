// placeholder until the data concern lands
