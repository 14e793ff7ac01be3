"""Wire: the producer <-> worker protocol (ROUTER/DEALER, msgpack header + raw tensor frames).

``messages`` holds the message types and the protocol version, ``codec`` turns them into frames and back,
``transport`` is the only module that imports zmq.
"""
