"""Small programs written against kvpark's public API; docs/ includes them and tests run them."""
