"""The running node: its training loop, each fragment's sync, a round's end, what it
reports about itself and the operator's commands it takes."""
