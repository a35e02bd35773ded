// placeholder until the io concern lands
