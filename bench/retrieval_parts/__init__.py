"""The parts of the retrieval benchmark (`python bench/retrieval.py PART`), one module each:
check, questions, recall, select, windows, passkey; and what they share: sources (the question
set, its documents and evidence), systems (the three ways of answering and their engines) and
running (systems over documents, options, summary and result)."""
