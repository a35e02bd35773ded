// placeholder until the dist concern lands
