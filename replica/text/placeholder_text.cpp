// placeholder until the text concern lands
