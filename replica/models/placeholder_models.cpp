// placeholder until the models concern lands
