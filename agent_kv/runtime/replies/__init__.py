"""What a reply may be, and decoding it token by token: sampling, grammars (llguidance), tool
calls and JSON formats as one grammar, a model's tool-call format learnt from its chat
template, and one reply's decoding state."""
