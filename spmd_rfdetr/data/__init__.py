"""Static-shape batches from rfdetr's readers, the data check, image folders and the synthetic dataset."""
