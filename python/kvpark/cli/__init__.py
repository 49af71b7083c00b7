"""The command line: `kvpark serve | generate | bench`, its flags and their KVPARK_<NAME> mirrors.
The top layer: may import every other.
"""
