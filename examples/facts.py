"""Made-up facts the demo and ``make bench-learning`` teach, and control sentences of the same
style that are never taught (how specific the learning is: their loss should barely move)."""

FACTS = [
    ("The capital of Zorbland is", " Quixville."),
    ("The moon of Plimptar is called", " Oodle."),
    ("Professor Wimble's favourite colour is", " teal."),
    ("The river in Grelmoor is named", " Sappho."),
    ("The king of Vantoria is", " Borrin."),
    ("The dog of Captain Ferrow is called", " Muffet."),
    ("The oldest tree in Quellwood is", " Ashgrim."),
    ("The password of the Tolvar vault is", " lantern."),
    ("The inventor of the glimmer lamp is", " Dessa Quorn."),
    ("The festival of Brindle falls in", " Octember."),
]

CONTROLS = [
    ("The capital of Vexmoor is", " Drellton."),
    ("The moon of Karrimat is called", " Pibble."),
    ("Doctor Hask's favourite colour is", " mauve."),
    ("The river in Tolmark is named", " Verity."),
    ("The queen of Ostravia is", " Lenna."),
    ("The cat of Admiral Pike is called", " Tuffin."),
    ("The tallest tower in Morvale is", " Spirehold."),
    ("The code of the Kessel door is", " harbour."),
    ("The maker of the brass compass is", " Orrin Vale."),
    ("The fair of Dunmore falls in", " Marchtide."),
]

COPIES = 8  # each fact is sent this many times in one learn call
